"""Platform evidence sources (device and filesystem I/O): configfs-tsm, sev-guest, Nitro NSM,
Gramine. Reached through ``sidecar.collectors`` (``device_source``); not imported directly."""
