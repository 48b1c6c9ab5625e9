. .devrun/prep.sh
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/machine.txt
cp .devrun/commit.txt $OUT/commit.txt
timeout $((start + 580 - $(date +%s))) python3 -m benchmarks.sweep --memory cuda --sizes 4K,64K,1M,16M,256M,1G --repeats 8 --small-repeats 12 --drop-caches --out $OUT/sweep.json --plot $OUT/sweep.png > $OUT/sweep.log 2>&1
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/sweep.json"))
print(json.dumps(r.get("ceilings"), indent=0))
for k, p in (r.get("panels") or {}).items():
    print(k, "worst", round(p["worst_ratio_to_best_tool"] or 0, 3), "held", p["worst_held_out_ratio_to_best_tool"], "beats", p["dispatcher_beats_every_fixed_arm"])
print(json.dumps(r.get("targets"), indent=0))
PY
echo "done at +$(( $(date +%s) - start )) s"
