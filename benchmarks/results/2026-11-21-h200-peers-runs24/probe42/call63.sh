# GPU tests and probe 42 (probe 41 again) on the warm-load fixes.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call63.sh .devrun/probe42.py $OUT/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; echo "tests rc $?"
tail -3 $OUT/gpu-tests.txt; grep FAILED $OUT/gpu-tests.txt | head
timeout 300 python3 .devrun/probe42.py $OUT/probe42.json 8 2>&1 | tee $OUT/probe42.log | grep -v "^ " | tail -30
