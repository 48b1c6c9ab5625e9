# Probe 29: warm 8 GiB loads with the page cache full, and with it free.
. .devrun/prep.sh
s0=$(date +%s)
cp .devrun/commit.txt .devrun/call39.sh .devrun/probe29.py $OUT/
free -g; df -h /tmp | tail -1
timeout 250 python3 .devrun/probe29.py $OUT/probe29.json 8 4 > $OUT/probe29.log 2>&1; echo "probe rc $?"
tail -42 $OUT/probe29.log
echo "all took $(( $(date +%s) - s0 )) s"
