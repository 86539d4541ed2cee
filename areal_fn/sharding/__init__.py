"""The sharding algebra: boxes, meshes, placements, shardings, PartitionSpec, shard/unshard, pictures of rank grids."""
