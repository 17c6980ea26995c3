"""Where a fit starts: the starting mixture (``mixture``: given arrays, k-means' means, the clusters'
covariances) and minibatch k-means (``kmeans``)."""
