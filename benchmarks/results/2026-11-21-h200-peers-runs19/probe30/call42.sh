# Probe 30: warm loads after one or two page-cache passes (8 GiB, 3 rounds + 1 untimed).
. .devrun/prep.sh
s0=$(date +%s)
cp .devrun/commit.txt .devrun/call42.sh .devrun/probe30.py $OUT/
timeout 400 python3 .devrun/probe30.py $OUT/probe30.json 8 3 > $OUT/probe30.log 2>&1; echo "rc $?"
tail -12 $OUT/probe30.log
echo "took $(( $(date +%s) - s0 )) s"
