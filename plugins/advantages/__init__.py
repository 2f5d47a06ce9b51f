"""Advantage estimators (``register_advantage_estimators``): one module per estimator."""
