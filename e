epsd: the --eps-* flags do not make a selection policy: strict mode replaces the budget rule; budget=fixed (epsd --help lists the flags)
