#!/usr/bin/env bash
# this session's one device call: (a) tests, ops, triton; (b) Table 5.2 at T = 4, 32 with the GEMM (a) picked
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 3
git rev-parse HEAD > $OUT/code.txt 2>/dev/null; git status --short >> $OUT/code.txt 2>/dev/null
TESTS_TIMEOUT_S=110 TRITON_TIMEOUT_S=170 SUITE_BUDGET_S=300 bash bench/gpu_suite.sh $OUT/a --steps tests,ops,triton
BM=$(python3 .devrun/pick.py $OUT/a/triton.json)
echo "picked max_bm=$BM" | tee -a $OUT/code.txt
LEFT=$(( ${DEADLINE:-550} - ($(date +%s) - T0) ))
echo "table budget ${LEFT}s"
if [ "$BM" != 0 ]; then export ITIF_TRITON_GEMM=1 ITIF_TRITON_MAX_BM=$BM; fi
TENANTS="4 32" COMPILED_MODELS=bert-base COMPILED_TENANTS=4 SUITE_BUDGET_S=$LEFT bash bench/gpu_suite.sh $OUT/b --steps table
cd $OUT && tar czf logs.tgz a/*.log b/*.log b/plots.tar.gz 2>/dev/null; rm -f a/*.log b/*.log b/plots.tar.gz; ls -R $OUT
