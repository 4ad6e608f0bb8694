"""The TOML front end: TOML files and overlays -> torchtitan's tyro flags."""
