"""All candidates' updates in one forward/backward: the multi-adapter LoRA layer (:mod:`.layer`), the chunks a
step's rows are cut into (:mod:`.chunks`) and the one-pass step through the adapter store (:mod:`.one_pass`)."""
