#!/bin/sh
# Build the enclave image, its EIF, the AttestationPolicy admitting exactly that EIF, and the
# parent image (run on a build host with docker and nitro-cli, e.g. Amazon Linux 2023 with
# aws-nitro-enclaves-cli-devel). REGISTRY and TAG name the images; mesh-root.pem must be here.
set -eu
REGISTRY=${REGISTRY:-registry.example.com/attestmesh}
TAG=${TAG:-0.1.0}
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."  # the build context: the repository root
docker build -f examples/nitro/Dockerfile --target enclave -t "enclave-app:${TAG}" .
nitro-cli build-enclave --docker-uri "enclave-app:${TAG}" --output-file "$HERE/app.eif" \
  > "$HERE/measurements.json"
attestmesh policy from-eif "$HERE/measurements.json" --name enclave-app --namespace demo \
  --service-account enclave-app -o "$HERE/enclave-app-policy.yaml"
docker build -f examples/nitro/Dockerfile --target parent \
  --build-arg EIF=examples/nitro/app.eif -t "${REGISTRY}/enclave-app-eif:${TAG}" .
docker push "${REGISTRY}/enclave-app-eif:${TAG}"
echo "kubectl apply -f enclave-app-policy.yaml, then the workload (annotation"
echo "attestmesh.dev/enclave-image: ${REGISTRY}/enclave-app-eif:${TAG})"
