. .devrun/prep.sh
start=$(date +%s)
cp .devrun/commit.txt .devrun/probe25.py .devrun/call32.sh $OUT/
root=$PWD
for k in 1 2; do
  (cd .devrun/old && timeout 100 python3 $root/.devrun/probe25.py $OUT/probe25-old-$k.json 8 5 > $OUT/probe25-old-$k.log 2>&1); tail -c 300 $OUT/probe25-old-$k.log | grep median -A0; python3 -c "import json;print('old', json.load(open('$OUT/probe25-old-$k.json'))['median_GBps'])"
  timeout 100 python3 .devrun/probe25.py $OUT/probe25-new-$k.json 8 5 > $OUT/probe25-new-$k.log 2>&1; python3 -c "import json;print('new', json.load(open('$OUT/probe25-new-$k.json'))['median_GBps'])"
done
echo "probes done at +$(( $(date +%s) - start )) s"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; tail -3 $OUT/gpu-tests.txt
echo "done at +$(( $(date +%s) - start )) s"
