"""``kvroute serve --processes N``: the supervisor and one gateway process's place in its group."""
