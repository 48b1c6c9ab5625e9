# Probe 41: where an 8 GiB warm load spends what raw KvikIO does not (library of e39f46c).
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call62.sh .devrun/probe41.py $OUT/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
timeout 420 python3 .devrun/probe41.py $OUT/probe41.json 8 2>&1 | tee $OUT/probe41.log | tail -80
