# GPU tests on this library, then probe 32 (fallocate and parallel O_DIRECT writes, 8 GiB).
. .devrun/prep.sh
s0=$(date +%s)
cp .devrun/commit.txt .devrun/call45.sh .devrun/probe32.py $OUT/
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; tail -3 $OUT/gpu-tests.txt; grep FAILED $OUT/gpu-tests.txt | head
echo "tests took $(( $(date +%s) - s0 )) s"
lsblk -o NAME,SIZE,TYPE,MOUNTPOINT > $OUT/lsblk.txt 2>&1; df -hT /tmp >> $OUT/lsblk.txt
timeout 380 python3 .devrun/probe32.py $OUT/probe32.json 8 3 vda > $OUT/probe32.log 2>&1; echo "rc $?"
tail -12 $OUT/probe32.log
