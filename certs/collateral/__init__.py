"""Vendor collateral: trust roots, offline bundles, and online fetchers with an on-disk cache."""
