#!/usr/bin/env bash
# The wheels a lent GPU machine (Python 3.12, its own torch and CuPy, no package registry) needs
# beyond its image to run the whole GPU suite: the gRPC stack and protobuf 7 of the itif.v1
# stubs, tritonclient with what its grpc and http modules import (the KServe v2 classes the
# daemon uses, the clients the tests drive), and grpcio-tools (tests/test_proto.py). Without
# python-rapidjson or gevent, tritonclient refuses to import and eight test modules fail to
# collect (seen on an H100 on 2026-11-26). prometheus-client: the daemon needs 0.24 or later
# (a removed tenant's series are dropped with Metric.remove_by_labels); the image's own copy may
# be older. peft: the image has one of unknown version; the decoder suite (--steps llama) is
# checked with this one (its transformers is the image's). Versions are those the CPU test
# environment runs.
#
#   bash bench/device_wheels.sh [DIR]        # default .whl (ignored by git: see the README)
#
# Then each device call carries DIR and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
DIR=${1:-.whl}
mkdir -p "$DIR"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done
WHEELS=(
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-tools==1.85.1
  protobuf==7.36.2
  tritonclient==2.73.0 python-rapidjson==1.25
  geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope.event zope.interface brotli==1.2.1
  prometheus-client==0.26.0
  peft==0.21.2
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DIR" "${WHEELS[@]}"
ls "$DIR"
du -sh "$DIR"
