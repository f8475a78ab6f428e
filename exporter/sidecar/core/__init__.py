"""The sidecar's core: keys, ranks, samples, rollups and the series window behind one facade (`state`); no I/O."""
