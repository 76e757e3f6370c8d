"""Tools over plans: sbpc check, the collective and schedule reports, the HTML report."""
