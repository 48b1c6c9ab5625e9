# GPU tests on the grouped checksum kernel, then probe 28 again (warm 8 GiB loads, verify on/off).
. .devrun/prep.sh
s0=$(date +%s)
cp .devrun/commit.txt .devrun/call40.sh $OUT/
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_device_checksum.py > $OUT/gpu-tests-crc.txt 2>&1; rc=$?; tail -3 $OUT/gpu-tests-crc.txt
if [ $rc -ne 0 ]; then grep -E "^E |Error|FAILED" $OUT/gpu-tests-crc.txt | head -30; exit 1; fi
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; tail -2 $OUT/gpu-tests.txt; grep FAILED $OUT/gpu-tests.txt | head
echo "tests took $(( $(date +%s) - s0 )) s"
timeout 120 python3 .devrun/probe28.py $OUT/probe28.json 8 5 > $OUT/probe28.log 2>&1; echo "probe rc $?"
tail -3 $OUT/probe28.log
echo "all took $(( $(date +%s) - s0 )) s"
