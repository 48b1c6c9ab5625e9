# GPU tests after the learned table's saves between transfers stopped fsyncing.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call56.sh $OUT/
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; echo "rc $?"
tail -3 $OUT/gpu-tests.txt; grep FAILED $OUT/gpu-tests.txt | head
