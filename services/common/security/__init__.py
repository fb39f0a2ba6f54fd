"""Who may do what: TLS on every hop (tls), identities from certificates (identity), the role table
(access), the deployment scope of an owner's writes (scope), transfer permits (permits), and the
throwaway CA of local runs and tests (pki).
"""
