"""The mesh CA, one job per module:

- ``certs.ca.templates``: certificate templates (leaf, CA, CRL, serving certificate). Pure.
- ``certs.ca.claims``: the claims extension codec and the claims class. Pure.
- ``certs.ca.authority``: ``CertificateAuthority`` (root, intermediates, trust bundle, CRLs)
  and intermediate rotation (pure predicates, persisted steps, ``rotation_step``).
- ``certs.ca.slots``: the state directory (durable private writes, the intermediate slots).
- ``certs.ca.issue``: ``issue(admission, ca, ...)``, the one way to a mesh leaf: it takes an
  ``Admission`` (``certs.issuance``), which only appraisal of verified evidence makes.
- ``certs.ca.serving``: the control plane's own serving credentials.

What others may import: the names below. The leaf template (``certs.ca.templates.build_leaf``)
is not among them: nothing above ``certs.ca`` imports ``certs.ca.templates`` (the ``leaf``
contract in pyproject.toml), so a mesh leaf is signed through ``issue`` only.
"""

from certs.ca.authority import (
    INTERMEDIATE_LIFETIME,
    MIN_INTERMEDIATE_LIFETIME,
    PREVIOUS_RETENTION,
    ROOT_LIFETIME,
    CertificateAuthority,
    SigningMaterial,
    activation_time,
    preparation_time,
    rotation_step,
)
from certs.ca.claims import (
    CLAIMS_CLASS_ORG,
    CLAIMS_CLASS_PREFIX,
    CLAIMS_OID,
    claims_class,
    decode_claims_extension,
    encode_claims_extension,
)
from certs.ca.issue import Leaf, issue
from certs.ca.serving import build_server_cert, issue_serving_credentials
from certs.ca.slots import NEXT_SLOT, PREVIOUS_SLOT
from certs.ca.templates import BACKDATE, Issuer, leaf_validity
from certs.csr import CsrError, parse_csr, spki_der

__all__ = [
    "BACKDATE",
    "CLAIMS_CLASS_ORG",
    "CLAIMS_CLASS_PREFIX",
    "CLAIMS_OID",
    "INTERMEDIATE_LIFETIME",
    "MIN_INTERMEDIATE_LIFETIME",
    "NEXT_SLOT",
    "PREVIOUS_RETENTION",
    "PREVIOUS_SLOT",
    "ROOT_LIFETIME",
    "CertificateAuthority",
    "CsrError",
    "Issuer",
    "Leaf",
    "SigningMaterial",
    "activation_time",
    "build_server_cert",
    "claims_class",
    "decode_claims_extension",
    "encode_claims_extension",
    "issue",
    "issue_serving_credentials",
    "leaf_validity",
    "parse_csr",
    "preparation_time",
    "rotation_step",
    "spki_der",
]
