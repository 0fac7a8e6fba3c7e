"""Where a round's candidates train: the :class:`~.executor.Executor` Protocol, in this process (:mod:`.local`)
or on trainer actors of a Ray cluster (:mod:`.ray_executor`, :mod:`.ray_actor`, :mod:`.ray_pool`), with the files
of a distributed round travelling through :mod:`.exchange`."""
