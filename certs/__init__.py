"""Attested issuance: who may hold a mesh certificate, and the CA that signs it."""
