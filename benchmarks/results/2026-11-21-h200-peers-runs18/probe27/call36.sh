# GPU tests on this library, then probe 27 (JAX wrapping; collector over whole loads).
. .devrun/prep.sh
s0=$(date +%s)
cp .devrun/commit.txt .devrun/call36.sh .devrun/probe27.py $OUT/
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; tail -3 $OUT/gpu-tests.txt
grep -E "FAILED|Error" $OUT/gpu-tests.txt | head -20
echo "tests took $(( $(date +%s) - s0 )) s"
timeout 300 python3 .devrun/probe27.py $OUT/probe27.json 8 6 > $OUT/probe27.log 2>&1; echo "probe rc $?"
tail -45 $OUT/probe27.log
echo "all took $(( $(date +%s) - s0 )) s"
