"""How a candidate learns: one module per algorithm (:mod:`.ppo` for GRPO and PPO-clip, :mod:`.offline_is`,
:mod:`.kto`) and their registry (:mod:`.registry`), the records a step works with (:mod:`.batch`), the losses
(:mod:`.losses`), the loss/clip/step core both update modes share (:mod:`.core`) and the sequential update
(:mod:`.update`)."""
