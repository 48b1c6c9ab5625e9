# Probe 28: warm 8 GiB loads, arrayio against raw KvikIO, with and without verification.
. .devrun/prep.sh
s0=$(date +%s)
cp .devrun/commit.txt .devrun/call38.sh .devrun/probe28.py $OUT/
timeout 280 python3 .devrun/probe28.py $OUT/probe28.json 8 5 > $OUT/probe28.log 2>&1; echo "probe rc $?"
tail -40 $OUT/probe28.log
echo "all took $(( $(date +%s) - s0 )) s"
