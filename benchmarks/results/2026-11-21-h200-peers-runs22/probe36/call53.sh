# Probe 36: a save right after torch.save (see .devrun/probe36.py).
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call53.sh .devrun/probe36.py $OUT/
timeout 560 python3 .devrun/probe36.py $OUT/probe36.json 8 3 > $OUT/probe36.log 2>&1; echo "rc $?"
tail -12 $OUT/probe36.log
