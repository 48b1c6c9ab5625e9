. .devrun/prep.sh
start=$(date +%s)
cp .devrun/commit.txt $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/machine.txt
rm -rf /tmp/aio-cache
timeout 440 python3 -m benchmarks.peers.checkpoint --gib 1 --repeats 5 --drop-caches --out $OUT/ckpt --deadline $(( start + 420 )) > $OUT/run15.log 2>&1
tail -36 $OUT/run15.log
echo "done at +$(( $(date +%s) - start )) s"
