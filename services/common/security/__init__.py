"""Who may do what: TLS on every hop (tls), identities from certificates (identity), the role table
(access), transfer permits (permits), and the throwaway CA of local runs and tests (pki).
"""
