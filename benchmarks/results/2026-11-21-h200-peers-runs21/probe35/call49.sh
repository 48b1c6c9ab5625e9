# Probe 35: a gathered writer prototype against the raw writes and the save (8 GiB).
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call49.sh .devrun/probe35.py $OUT/
timeout 400 python3 .devrun/probe35.py $OUT/probe35.json 8 3 > $OUT/probe35.log 2>&1; echo "rc $?"
tail -12 $OUT/probe35.log
