"""``megathunder plan``: memory and traffic of a learner layout, predicted before launch."""
