"""The fitter families: batch EM, minibatch (online) EM, SGD and the methods built on them (SQUAREM,
split-and-merge, Polyak-Ruppert averaging, a fitted background), with their step schedules and the
re-seeding of dead components."""
