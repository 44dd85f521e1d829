//! Proof of possession for an agent that attaches through a relay.
//!
//! A direct agent proves that it holds its certificate's key in the TLS handshake. A
//! relayed agent's handshake ends at the relay, and the primary sees only the chain the
//! relay forwards, which is no secret. So the primary sends a fresh nonce through the
//! relay ([`Challenge`]), and the agent signs, with its certificate's key, the bytes
//! [`signed_bytes`] lays out: a context string, the nonce, its own hello's node,
//! service, address and zone, and the primary's name. The primary checks the
//! signature against the forwarded end-entity certificate before it admits the slot.
//! A relay can then carry only agents really behind it, saying only what they said;
//! and a proof made for one primary and nonce is good for no other.
//!
//! The key types: ECDSA P-256 (what `certs` issues) and P-384, and Ed25519. Others
//! (RSA) are refused with [`ProofError::UnsupportedKey`].

use crate::wire::{Challenge, Hello, Proof};
use rustls::pki_types::CertificateDer;
pub use rustls::sign::SigningKey;
use rustls::SignatureScheme;

/// What every signature starts with, so that it cannot pass for a signature of
/// anything else made with the same key (a TLS handshake's, say).
pub const CONTEXT: &[u8] = b"ballast relayed attach proof v1\0";

/// The signature schemes a proof may use, in the order an agent prefers them.
pub const SCHEMES: [SignatureScheme; 3] = [
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
];

/// Why a proof could not be made or was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    /// The key is of a type proofs do not use.
    #[error("the certificate's key is of a type relayed proofs do not support (ECDSA P-256, P-384 or Ed25519 only)")]
    UnsupportedKey,
    /// The proof names a signature scheme proofs do not use.
    #[error("signature scheme {0:#06x} is not one relayed proofs use")]
    UnsupportedScheme(u16),
    /// The end-entity certificate does not parse.
    #[error("the agent's certificate does not parse: {0}")]
    BadCertificate(String),
    /// The signature is not the certificate key's over these bytes: another key, or
    /// another nonce, hello or primary.
    #[error("the signature does not verify with the agent's certificate for this nonce, hello and primary")]
    BadSignature,
    /// The agent's key would not sign.
    #[error("signing failed: {0}")]
    Sign(String),
    /// The agent cannot prove: it speaks a protocol without proofs.
    #[error("the agent cannot prove it holds its key (it speaks {0})")]
    Unproven(String),
}

impl ProofError {
    /// A short, stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ProofError::UnsupportedKey | ProofError::UnsupportedScheme(_) => "unsupported_key",
            ProofError::BadCertificate(_) => "bad_certificate",
            ProofError::BadSignature | ProofError::Sign(_) => "bad_proof",
            ProofError::Unproven(_) => "unproven",
        }
    }
}

/// The bytes an agent signs: [`CONTEXT`], the nonce, then the hello's node, service,
/// address and zone and the primary's name, each behind its length (a u16, big
/// endian), so that no two different tuples give the same bytes.
pub fn signed_bytes(challenge: &Challenge, hello: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(CONTEXT.len() + challenge.nonce.len() + 128);
    out.extend_from_slice(CONTEXT);
    out.extend_from_slice(&challenge.nonce);
    for field in [
        &hello.node,
        &hello.service,
        &hello.address,
        &hello.zone,
        &challenge.primary,
    ] {
        // Every field is held to far less than 64 KiB by its own limit.
        let len = u16::try_from(field.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(field.as_bytes().get(..usize::from(len)).unwrap_or_default());
    }
    out
}

/// The signing key of a private key, as an agent signs its proofs with it.
pub fn signing_key(
    key: &rustls::pki_types::PrivateKeyDer<'_>,
) -> Result<std::sync::Arc<dyn SigningKey>, ProofError> {
    rustls::crypto::ring::sign::any_supported_type(key).map_err(|_| ProofError::UnsupportedKey)
}

/// The agent's proof for `challenge`, with its certificate's key `key`, over its own
/// `hello`.
pub fn sign(
    key: &dyn SigningKey,
    challenge: &Challenge,
    hello: &Hello,
) -> Result<Proof, ProofError> {
    let signer = key
        .choose_scheme(&SCHEMES)
        .ok_or(ProofError::UnsupportedKey)?;
    let signature = signer
        .sign(&signed_bytes(challenge, hello))
        .map_err(|e| ProofError::Sign(e.to_string()))?;
    Ok(Proof {
        scheme: u16::from(signer.scheme()),
        signature,
    })
}

/// Whether `proof` is a signature by the key of `leaf` (the agent's end-entity
/// certificate, as the relay forwarded it) over `challenge` and `hello`.
pub fn verify(
    leaf: &CertificateDer<'_>,
    challenge: &Challenge,
    hello: &Hello,
    proof: &Proof,
) -> Result<(), ProofError> {
    let scheme = SignatureScheme::from(proof.scheme);
    if !SCHEMES.contains(&scheme) {
        return Err(ProofError::UnsupportedScheme(proof.scheme));
    }
    let cert = webpki::EndEntityCert::try_from(leaf)
        .map_err(|e| ProofError::BadCertificate(e.to_string()))?;
    let algorithms = rustls::crypto::ring::default_provider().signature_verification_algorithms;
    let candidates = algorithms
        .mapping
        .iter()
        .find(|(s, _)| *s == scheme)
        .map(|(_, algs)| *algs)
        .ok_or(ProofError::UnsupportedScheme(proof.scheme))?;
    let message = signed_bytes(challenge, hello);
    let mut key_fits = false;
    for alg in candidates {
        match cert.verify_signature(*alg, &message, &proof.signature) {
            Ok(()) => return Ok(()),
            Err(webpki::Error::UnsupportedSignatureAlgorithmForPublicKeyContext(_)) => {}
            Err(_) => key_fits = true,
        }
    }
    if key_fits {
        Err(ProofError::BadSignature)
    } else {
        Err(ProofError::UnsupportedKey)
    }
}

/// A self-signed certificate naming `node`, with a key of `alg`, and its signing key:
/// for the tests of the machines that carry proofs.
#[cfg(test)]
pub(crate) fn test_identity(
    node: &str,
    alg: &'static rcgen::SignatureAlgorithm,
) -> (CertificateDer<'static>, std::sync::Arc<dyn SigningKey>) {
    let key = rcgen::KeyPair::generate_for(alg).expect("key");
    let cert = rcgen::CertificateParams::new(vec![node.to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("certificate");
    let der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("der");
    (cert.der().clone(), signing_key(&der).expect("signer"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::NONCE_LEN;

    fn hello() -> Hello {
        Hello {
            node: "web-1".into(),
            service: "web".into(),
            address: "10.0.0.1:80".into(),
            zone: "z1".into(),
            version: "1".into(),
        }
    }

    fn challenge() -> Challenge {
        Challenge {
            nonce: [9; NONCE_LEN],
            primary: "r1".into(),
        }
    }

    fn identity(
        alg: &'static rcgen::SignatureAlgorithm,
    ) -> (CertificateDer<'static>, std::sync::Arc<dyn SigningKey>) {
        test_identity("web-1", alg)
    }

    #[test]
    fn a_proof_verifies_for_its_own_nonce_hello_and_primary_only() {
        for alg in [
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rcgen::PKCS_ECDSA_P384_SHA384,
            &rcgen::PKCS_ED25519,
        ] {
            let (cert, key) = identity(alg);
            let proof = sign(key.as_ref(), &challenge(), &hello()).expect("signs");
            assert_eq!(verify(&cert, &challenge(), &hello(), &proof), Ok(()));
            let other_nonce = Challenge {
                nonce: [8; NONCE_LEN],
                ..challenge()
            };
            let other_primary = Challenge {
                primary: "r2".into(),
                ..challenge()
            };
            let other_hello = Hello {
                address: "10.0.0.2:80".into(),
                ..hello()
            };
            assert_eq!(
                verify(&cert, &other_nonce, &hello(), &proof),
                Err(ProofError::BadSignature)
            );
            assert_eq!(
                verify(&cert, &other_primary, &hello(), &proof),
                Err(ProofError::BadSignature)
            );
            assert_eq!(
                verify(&cert, &challenge(), &other_hello, &proof),
                Err(ProofError::BadSignature)
            );
        }
    }

    #[test]
    fn a_proof_by_another_key_is_refused() {
        let (cert, _) = identity(&rcgen::PKCS_ECDSA_P256_SHA256);
        let (_, other) = identity(&rcgen::PKCS_ECDSA_P256_SHA256);
        let proof = sign(other.as_ref(), &challenge(), &hello()).expect("signs");
        assert_eq!(
            verify(&cert, &challenge(), &hello(), &proof),
            Err(ProofError::BadSignature)
        );
        // A P-384 signature for a P-256 certificate: the key does not take it.
        let (_, p384) = identity(&rcgen::PKCS_ECDSA_P384_SHA384);
        let proof = sign(p384.as_ref(), &challenge(), &hello()).expect("signs");
        assert!(verify(&cert, &challenge(), &hello(), &proof).is_err());
    }

    #[test]
    fn unsupported_schemes_and_garbage_are_refused_with_a_reason() {
        let (cert, key) = identity(&rcgen::PKCS_ECDSA_P256_SHA256);
        let mut proof = sign(key.as_ref(), &challenge(), &hello()).expect("signs");
        proof.scheme = u16::from(SignatureScheme::RSA_PKCS1_SHA256);
        assert_eq!(
            verify(&cert, &challenge(), &hello(), &proof),
            Err(ProofError::UnsupportedScheme(0x0401))
        );
        let garbage = Proof {
            scheme: u16::from(SignatureScheme::ECDSA_NISTP256_SHA256),
            signature: vec![0; 3],
        };
        assert_eq!(
            verify(&cert, &challenge(), &hello(), &garbage),
            Err(ProofError::BadSignature)
        );
        let bad_cert = CertificateDer::from(vec![1, 2, 3]);
        assert!(matches!(
            verify(&bad_cert, &challenge(), &hello(), &garbage),
            Err(ProofError::BadCertificate(_))
        ));
    }

    #[test]
    fn fields_cannot_be_shifted_between_each_other() {
        let a = Hello {
            node: "ab".into(),
            service: "c".into(),
            ..hello()
        };
        let b = Hello {
            node: "a".into(),
            service: "bc".into(),
            ..hello()
        };
        assert_ne!(
            signed_bytes(&challenge(), &a),
            signed_bytes(&challenge(), &b)
        );
    }
}
