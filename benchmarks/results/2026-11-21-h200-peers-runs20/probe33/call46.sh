# Probe 33: a save's timeline against the raw host write's (8 GiB).
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call46.sh .devrun/probe33.py $OUT/
timeout 200 python3 .devrun/probe33.py $OUT/probe33.json 8 3 vda > $OUT/probe33.log 2>&1; echo "rc $?"
tail -12 $OUT/probe33.log | cut -c1-400
