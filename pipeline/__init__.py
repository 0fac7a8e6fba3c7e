"""Control: typed config, local stack, registry, serving control, scheduler,
ops API, CLI and the always-on service."""
