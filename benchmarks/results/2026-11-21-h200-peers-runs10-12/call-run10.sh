. .devrun/prep.sh
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/machine.txt
timeout 70 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log
rm -rf /tmp/aio-cache
timeout 300 python3 .devrun/tune_ckpt.py $OUT/tune.json > $OUT/tune.log 2>&1; tail -2 $OUT/tune.log
mkdir -p $OUT/aio-cache-tuned && cp /tmp/aio-cache/*.json $OUT/aio-cache-tuned/
echo "tuned at +$(( $(date +%s) - start )) s"
timeout $(( start + 585 - $(date +%s) )) python3 -m benchmarks.peers.checkpoint --gib 1 --repeats 5 --drop-caches --out $OUT/ckpt --deadline $(( start + 565 )) > $OUT/run10.log 2>&1
tail -36 $OUT/run10.log
mkdir -p $OUT/aio-cache && cp /tmp/aio-cache/*.json $OUT/aio-cache/
echo "done at +$(( $(date +%s) - start )) s"
