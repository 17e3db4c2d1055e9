"""Several devices: tensor / expert sharding over one mesh, several hosts, data-parallel replicas."""
