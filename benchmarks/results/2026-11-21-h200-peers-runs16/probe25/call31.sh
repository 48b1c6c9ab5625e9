. .devrun/prep.sh
start=$(date +%s)
cp .devrun/commit.txt .devrun/probe25.py $OUT/
timeout 300 python3 .devrun/probe25.py $OUT/probe25.json 8 5 2>&1 | tee $OUT/probe25.log | grep -v "^ *[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* {built-in\|^$" | tail -60
echo "done at +$(( $(date +%s) - start )) s"
