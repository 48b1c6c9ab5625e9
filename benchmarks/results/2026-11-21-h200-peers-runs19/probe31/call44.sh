# Probe 31: where an 8 GiB save loses against the write ceiling.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call44.sh .devrun/probe31.py $OUT/
timeout 150 python3 .devrun/probe31.py $OUT/probe31.json 8 3 > $OUT/probe31.log 2>&1; echo "rc $?"
tail -14 $OUT/probe31.log
