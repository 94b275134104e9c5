"""Pearson's chi-square goodness-of-fit test, for the statistical tests
(the project depends on no statistics package)."""

import math


def _upper_regularized_gamma(a: float, x: float) -> float:
    """Q(a, x) = Γ(a, x) / Γ(a): a series below a + 1, a continued fraction
    above (Numerical Recipes' gammq)."""
    if x <= 0:
        return 1.0
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return 1.0 - total * math.exp(-x + a * math.log(x) - math.lgamma(a))
    b = x + 1 - a
    c = 1 / 1e-300
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square with ``dof`` degrees of freedom."""
    return _upper_regularized_gamma(dof / 2, statistic / 2)


def goodness_of_fit(
    counts: dict, probabilities: dict, min_expected: float = 5.0
) -> float:
    """The p-value of observing ``counts`` (category -> count) under
    ``probabilities`` (category -> probability, summing to at most 1; the
    rest is an implicit "other" category). Categories expected fewer than
    ``min_expected`` times are pooled into "other"."""
    n = sum(counts.values())
    observed, expected = [], []
    other_obs, other_exp = 0, n * max(0.0, 1.0 - sum(probabilities.values()))
    for category, p in probabilities.items():
        if n * p >= min_expected:
            observed.append(counts.get(category, 0))
            expected.append(n * p)
        else:
            other_obs += counts.get(category, 0)
            other_exp += n * p
    other_obs += sum(c for k, c in counts.items() if k not in probabilities)
    if other_exp > 0:
        observed.append(other_obs)
        expected.append(other_exp)
    elif other_obs:
        return 0.0  # something the distribution rules out happened
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return chi2_sf(statistic, len(observed) - 1)
