"""The Kubernetes names attestmesh shares: API group, labels, annotations, taints, condition
types, the token audience, the trust-bundle ConfigMap and the Nitro Enclaves resource names.

The one place they are defined. Pure (the standard library only): the injector
(``sidecar.inject``), the linter (``attestmesh.lint``), the control plane's Kubernetes mode and
the adapter modules of this package import them from here, and importing this module loads
nothing else of the adapter (``xds.kube`` resolves its other names lazily).
"""

from __future__ import annotations

from types import MappingProxyType

# The custom resources' API group (defined once, by the pure policy parser that checks documents
# against it: certs may not import xds) and version (AttestationPolicy, MeshPolicy, SecretPolicy).
from certs.policy import API_GROUP as GROUP

VERSION = "v1alpha1"

# Opt-in and opt-out: a namespace or pod label ``enabled``/``disabled``; the pod annotation
# ``"false"`` opts out (sidecar.inject). The same key for label and annotation.
LABEL_INJECT = "attestmesh.dev/inject"
ANNOTATION_INJECT = "attestmesh.dev/inject"
# Written by the injector onto the pods it mutated; read by the adapter (registration_from_pod).
ANNOTATION_INJECTED = "attestmesh.dev/injected"
ANNOTATION_INBOUND_PORT = "attestmesh.dev/inbound-port"
ANNOTATION_APP_PORT = "attestmesh.dev/app-port"
ANNOTATION_OUTBOUND = "attestmesh.dev/outbound"
DEFAULT_INBOUND_PORT = 15006

# Quarantine: the pod label, the node label and taint a platform failure puts on its node, and
# the pod condition; the custom resources' validation condition.
LABEL_QUARANTINED = "attestmesh.dev/quarantined"
LABEL_PLATFORM_UNTRUSTED = "attestmesh.dev/platform-untrusted"
TAINT_PLATFORM_UNTRUSTED = "attestmesh.dev/platform-untrusted"
CONDITION_ATTESTED = "AttestmeshAttested"
CONDITION_ACCEPTED = "Accepted"
# The Events' source and reporting component.
COMPONENT = "attestmesh-controlplane"

# The audience of the projected service-account token the injector mounts into every agent and
# the control plane asks TokenReview for.
TOKEN_AUDIENCE = "attestmesh"  # noqa: S105 (an audience, not a secret)
# TokenReview ``status.user.extra`` keys the API server sets for a token bound to a pod (a
# projected service-account token): the pod's name and uid.
EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"

# Kubernetes' own namespaces: never injected, whatever their labels say (the webhook's
# namespaceSelector excludes them by ``kubernetes.io/metadata.name`` from 1.21; the injector
# answers "allowed, no patch" for them itself, for servers that do not set that label).
SYSTEM_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease"})

# The mesh root bundle: the control plane keeps this ConfigMap (key ``root.pem``) in every
# namespace with injected pods; injected agents and Envoys mount it.
TRUST_CONFIGMAP = "attestmesh-trust-bundle"
TRUST_KEY = "root.pem"
# The labels the control plane puts on what it creates (the trust-bundle ConfigMaps).
MANAGED_LABELS = MappingProxyType(
    {"app.kubernetes.io/managed-by": "attestmesh", "app.kubernetes.io/part-of": "attestmesh"}
)

# AWS Nitro Enclaves (the device plugin's extended resources, hugepages, and the label and
# taint of the enclave NodePool, which is also the device plugin's container name).
NITRO_ENCLAVES = "aws.ec2.nitro/nitro_enclaves"
NITRO_ENCLAVE_CPUS = "aws.ec2.nitro/nitro_enclaves_cpus"
NITRO_RESOURCE_PREFIX = "aws.ec2.nitro/"
HUGEPAGES_1GI = "hugepages-1Gi"
HUGEPAGES_1GI_MEDIUM = "HugePages-1Gi"
NITRO_DP_LABEL = "aws-nitro-enclaves-k8s-dp"

__all__ = [
    "ANNOTATION_APP_PORT",
    "ANNOTATION_INBOUND_PORT",
    "ANNOTATION_INJECT",
    "ANNOTATION_INJECTED",
    "ANNOTATION_OUTBOUND",
    "COMPONENT",
    "CONDITION_ACCEPTED",
    "CONDITION_ATTESTED",
    "DEFAULT_INBOUND_PORT",
    "EXTRA_POD_NAME",
    "EXTRA_POD_UID",
    "GROUP",
    "HUGEPAGES_1GI",
    "HUGEPAGES_1GI_MEDIUM",
    "LABEL_INJECT",
    "LABEL_PLATFORM_UNTRUSTED",
    "LABEL_QUARANTINED",
    "MANAGED_LABELS",
    "NITRO_DP_LABEL",
    "NITRO_ENCLAVES",
    "NITRO_ENCLAVE_CPUS",
    "NITRO_RESOURCE_PREFIX",
    "TAINT_PLATFORM_UNTRUSTED",
    "TOKEN_AUDIENCE",
    "TRUST_CONFIGMAP",
    "TRUST_KEY",
    "VERSION",
]
