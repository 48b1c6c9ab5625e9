# Probe 37: writes not aligned to 4 MiB in the file (see .devrun/probe37.py).
. .devrun/prep.sh
df /tmp | tail -1; cat /sys/block/vda/vda*/start | tr "\n" " "; echo; cat /sys/block/vda/queue/max_sectors_kb /sys/block/vda/queue/max_hw_sectors_kb /sys/block/vda/queue/optimal_io_size /sys/block/vda/queue/physical_block_size /sys/block/vda/queue/nr_requests 2>&1 | tr '\n' ' '; echo
cp .devrun/commit.txt .devrun/call54.sh .devrun/probe37.py $OUT/
timeout 500 python3 .devrun/probe37.py $OUT/probe37.json 8 5 > $OUT/probe37.log 2>&1; echo "rc $?"
tail -9 $OUT/probe37.log
