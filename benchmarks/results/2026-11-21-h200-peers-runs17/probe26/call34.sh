. .devrun/prep.sh
start=$(date +%s)
cp .devrun/commit.txt .devrun/probe26.py .devrun/call34.sh $OUT/
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/machine.txt
free -g | head -2; df -h /tmp | tail -1
timeout 400 python3 .devrun/probe26.py $OUT/probe26.json 8 4 4 2 > $OUT/probe26.log 2>&1; echo "rc $?"
tail -30 $OUT/probe26.log | cut -c1-1500
echo "done at +$(( $(date +%s) - start )) s"
