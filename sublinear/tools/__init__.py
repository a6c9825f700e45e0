"""Tools built on the library: the command line (:mod:`.cli`), the max-batch search (:mod:`.maxbatch`), plan
reports and plots (:mod:`.report`) and the baselines sublinear is compared with (:mod:`.baselines`)."""
