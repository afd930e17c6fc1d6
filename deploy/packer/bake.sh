#!/bin/bash
# Rendered by cloud.image.render_bake (python -m cloud.image bake-script): make this image meet
# TrainMover's image contract with torch 2.13.0 (https://download.pytorch.org/whl/cu128).
set -euo pipefail
umask 022
id -u trainmover >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /opt/trainmover/work --shell /usr/sbin/nologin trainmover
mkdir -p /opt/trainmover/work && chown trainmover: /opt/trainmover/work && chmod 0750 /opt/trainmover/work
tm_python=""
tm_tried=""
for candidate in /opt/trainmover/python/bin/python /opt/conda/envs/pytorch/bin/python /opt/conda/bin/python /anaconda/envs/azureml_py310_sdkv2/bin/python python3.13 python3.12 python3.11 python3; do
  command -v "$candidate" >/dev/null 2>&1 || continue
  if why="$("$candidate" -c 'import sys; assert sys.version_info >= (3, 11), sys.version.split()[0]; import torch; v = torch.__version__.split('"'"'+'"'"')[0]; assert v == '"'"'2.13.0'"'"', '"'"'torch '"'"' + v  # noqa' 2>&1)"; then
    tm_python="$(command -v "$candidate")"
    break
  fi
  tm_tried="$tm_tried $candidate ($(echo "$why" | tail -n 1))"
done
if [ -z "$tm_python" ]; then
  echo "trainmover bake: no Python 3.11+ with torch 2.13.0 in the image (tried:${tm_tried:- none}); making /opt/trainmover/python"
  if ! command -v python3.11 >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    for attempt in $(seq 1 3); do
      if apt-get update -qq && apt-get install -y -qq --no-install-recommends python3.11 python3.11-venv; then break; fi
      if [ "$attempt" -eq 3 ]; then
        echo 'trainmover bake: installing python3.11 with apt failed 3 times' >&2
        exit 1
      fi
      sleep $((attempt * 10))
    done
  fi
  [ -x /opt/trainmover/python/bin/python ] || python3.11 -m venv /opt/trainmover/python  # a bake run again keeps what it made
  for attempt in $(seq 1 3); do
    if /opt/trainmover/python/bin/python -m pip install --no-input --disable-pip-version-check torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128; then break; fi
    if [ "$attempt" -eq 3 ]; then
      echo 'trainmover bake: installing torch 2.13.0 failed 3 times' >&2
      exit 1
    fi
    sleep $((attempt * 10))
  done
  tm_python=/opt/trainmover/python/bin/python
fi
for attempt in $(seq 1 3); do
  if "$tm_python" -m pip install --no-input --disable-pip-version-check 'numpy>=1.26' 'pydantic>=2.6' 'cryptography>=42' 'blake3>=0.4' 'boto3>=1.34'; then break; fi
  if [ "$attempt" -eq 3 ]; then
    echo 'trainmover bake: installing numpy>=1.26, pydantic>=2.6, cryptography>=42, blake3>=0.4, boto3>=1.34 failed 3 times' >&2
    exit 1
  fi
  sleep $((attempt * 10))
done
"$tm_python" -c "import torch; print('trainmover bake: python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda or 'none')"
if command -v cloud-init >/dev/null 2>&1; then cloud-init clean --logs; fi
rm -rf /var/lib/apt/lists/* /root/.cache/pip
