. .devrun/prep.sh
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/machine.txt
rm -rf /tmp/aio-cache
timeout 555 python3 -m benchmarks.peers.checkpoint --gib 1 --repeats 5 --drop-caches --out $OUT/ckpt --deadline $(( start + 535 )) > $OUT/run13.log 2>&1
tail -36 $OUT/run13.log
echo "done at +$(( $(date +%s) - start )) s"
