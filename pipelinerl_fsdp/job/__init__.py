"""The job around the roles: the torchrun world and its process groups, and the layout of the weight sync that
both ends of it follow."""
