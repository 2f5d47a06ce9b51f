"""Running ``plait <method>``: a YAML recipe or TRL's flat command line read into a Config, checked,
and launched on one process or many."""
