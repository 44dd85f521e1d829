//! The API's OpenAPI 3.1 document, generated from the handlers' `#[utoipa::path]`
//! annotations and the `ToSchema` derives of the types they serve, so that it cannot
//! drift from what the handlers answer.
//!
//! Two things are settled here rather than by the derives:
//! - Every property is required. The API's JSON is written by serde with no
//!   `skip_serializing_if`: every field is always present, and a `None` is `null`.
//!   utoipa marks `Option` fields and fields with a serde default as optional, which
//!   is true of what serde would read, not of what the API writes.
//! - The event of the weight watch stream ([`WeightEvent`]): its `data` is a
//!   [`WeightSet`](super::views::WeightSet) as JSON text, which the schema names with
//!   `contentMediaType` and `contentSchema`.

use serde_json::Value;
use std::sync::OnceLock;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;
use utoipa::OpenApi;

/// What the document says of numbers, whatever their field.
const NUMBERS: &str = "Numbers are always finite. JSON has no NaN or infinity (the \
     serializer would write `null` for one), so the balancing core replaces a \
     non-finite or negative report with 0 and clamps loads at 100 before any figure \
     is computed, and parameters must be finite to be accepted: a field is `null` \
     only where its schema says it may be.";

/// The generated document; [`document`] serves it with the fix-ups of this module.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Ballast aggregator API",
        description = "Services, endpoints and published weights of a Ballast aggregator. \
            Weights are normalised so that their mean over serving endpoints is 1.0. \
            Every error, whatever its status, has the `ErrorBody` shape; an unknown \
            path answers 404 with it."
    ),
    paths(
        super::healthz,
        super::metrics,
        super::services,
        super::service,
        super::endpoints,
        super::weights,
        super::config,
        super::published,
        super::openapi_v1,
        super::openapi,
        super::act::drain,
        super::act::undrain,
        super::act::hold,
        super::act::release,
        super::act::pin,
        super::act::unpin,
        super::act::audit,
    ),
    components(schemas(super::views::ErrorBody, WeightEvent)),
    tags(
        (name = "services", description = "Services, their endpoints and published weights"),
        (name = "config", description = "The per-service config directory"),
        (name = "operations", description = "Health and Prometheus metrics"),
        (name = "document", description = "This document"),
        (name = "actions", description = "Operators' actions (the operator role) and their audit trail"),
    )
)]
struct ApiDoc;

/// One server-sent event of `GET /v1/services/{name}/weights?watch=true`, as an
/// event-stream parser reads it: the `weights` event, the weight version as its id, and
/// the whole weight set as JSON in its data.
pub(crate) struct WeightEvent;

impl utoipa::PartialSchema for WeightEvent {
    fn schema() -> RefOr<Schema> {
        let string = || ObjectBuilder::new().schema_type(Type::String);
        ObjectBuilder::new()
            .description(Some(
                "One server-sent event of the weight watch stream. Comment lines (`:`) \
                 keep an idle stream open and carry no event.",
            ))
            .property(
                "event",
                string()
                    .enum_values(Some(["weights"]))
                    .description(Some("Always `weights`.")),
            )
            .required("event")
            .property(
                "id",
                string()
                    .pattern(Some("^[0-9]+$"))
                    .description(Some("The weight version, as `version` in the data.")),
            )
            .required("id")
            .property(
                "data",
                string()
                    .content_media_type("application/json")
                    .description(Some("The service's whole weight set, a `WeightSet`.")),
            )
            .required("data")
            .into()
    }
}

impl utoipa::ToSchema for WeightEvent {}

/// The document of an open API, built once: OpenAPI 3.1 as JSON text.
#[cfg(test)]
pub(crate) fn document() -> &'static str {
    document_with(false, false)
}

/// The document as an aggregator with `auth` serves it: with the security schemes
/// it takes (bearer tokens, client certificates) on every route but `/healthz`.
pub(crate) fn document_for(auth: &super::auth::Auth) -> &'static str {
    document_with(auth.takes_tokens(), auth.takes_certificates())
}

fn document_with(bearer: bool, mutual_tls: bool) -> &'static str {
    static DOCS: [OnceLock<String>; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    DOCS[usize::from(bearer) * 2 + usize::from(mutual_tls)].get_or_init(|| {
        let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or(Value::Null);
        fix_up(&mut doc);
        secure(&mut doc, bearer, mutual_tls);
        serde_json::to_string_pretty(&doc).unwrap_or_default()
    })
}

/// Adds the security schemes in force, as the requirement of every operation but the
/// health check, with the answers of a refused request.
fn secure(doc: &mut Value, bearer: bool, mutual_tls: bool) {
    use serde_json::json;
    if !bearer && !mutual_tls {
        return;
    }
    let mut schemes = serde_json::Map::new();
    let mut requirements = Vec::new();
    if bearer {
        schemes.insert(
            "bearer".into(),
            json!({
                "type": "http",
                "scheme": "bearer",
                "description": "A token of the aggregator's token file \
                    (`[http_auth] tokens`), as `Authorization: Bearer TOKEN`. Its role: \
                    `viewer` reads every route, `operator` also acts, `scrape` reads \
                    `/metrics` only."
            }),
        );
        requirements.push(json!({ "bearer": [] }));
    }
    if mutual_tls {
        schemes.insert(
            "mutualTLS".into(),
            json!({
                "type": "mutualTLS",
                "description": "A client certificate from the CA of `[http_tls] ca`, \
                    whose name holds a role by `[http_auth.cert_roles]`."
            }),
        );
        requirements.push(json!({ "mutualTLS": [] }));
    }
    if let Some(Value::Object(components)) = doc.pointer_mut("/components") {
        components.insert("securitySchemes".into(), Value::Object(schemes));
    }
    if let Value::Object(top) = doc {
        top.insert("security".into(), Value::Array(requirements));
    }
    let error = |description: &str| {
        json!({
            "description": description,
            "content": { "application/json": {
                "schema": { "$ref": "#/components/schemas/ErrorBody" }
            } }
        })
    };
    let Some(Value::Object(paths)) = doc.pointer_mut("/paths") else {
        return;
    };
    for (path, item) in paths.iter_mut() {
        let Value::Object(operations) = item else {
            continue;
        };
        for operation in operations.values_mut() {
            let Value::Object(op) = operation else {
                continue;
            };
            if path == "/healthz" {
                op.insert("security".into(), json!([]));
                continue;
            }
            if let Some(Value::Object(responses)) = op.get_mut("responses") {
                responses.insert(
                    "401".into(),
                    error("No credential, or a token that is not valid"),
                );
                responses.insert(
                    "403".into(),
                    error("The credential's role does not reach this route"),
                );
            }
        }
    }
}

/// The fix-ups the module's documentation lists, on the document as JSON.
fn fix_up(doc: &mut Value) {
    if let Some(Value::String(text)) = doc.pointer_mut("/info/description") {
        text.push_str("\n\n");
        text.push_str(NUMBERS);
    }
    if let Some(Value::Object(schemas)) = doc.pointer_mut("/components/schemas") {
        // Request bodies are what serde reads: their optional fields stay optional.
        for (_, schema) in schemas
            .iter_mut()
            .filter(|(name, _)| !super::act::REQUEST_BODIES.contains(&name.as_str()))
        {
            require_every_property(schema);
        }
    }
    if let Some(Value::Object(data)) =
        doc.pointer_mut("/components/schemas/WeightEvent/properties/data")
    {
        data.insert(
            "contentSchema".into(),
            serde_json::json!({ "$ref": "#/components/schemas/WeightSet" }),
        );
    }
}

/// Marks every property of `schema`, and of the schemas within it, required.
fn require_every_property(schema: &mut Value) {
    let Value::Object(map) = schema else {
        return;
    };
    if let Some(Value::Object(properties)) = map.get("properties") {
        let names: Vec<Value> = properties.keys().cloned().map(Value::String).collect();
        map.insert("required".into(), Value::Array(names));
    }
    for keyword in ["properties", "patternProperties"] {
        if let Some(Value::Object(children)) = map.get_mut(keyword) {
            children.values_mut().for_each(require_every_property);
        }
    }
    for keyword in ["items", "additionalProperties", "not"] {
        if let Some(child) = map.get_mut(keyword) {
            require_every_property(child);
        }
    }
    for keyword in ["oneOf", "anyOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(children)) = map.get_mut(keyword) {
            children.iter_mut().for_each(require_every_property);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> Value {
        serde_json::from_str(document()).expect("the document is JSON")
    }

    #[test]
    fn it_is_openapi_3_1_with_every_route() {
        let doc = doc();
        assert_eq!(doc["openapi"], "3.1.0");
        for path in [
            "/healthz",
            "/metrics",
            "/openapi.json",
            "/v1/openapi.json",
            "/v1/services",
            "/v1/services/{name}",
            "/v1/services/{name}/endpoints",
            "/v1/services/{name}/weights",
            "/v1/config",
            "/v1/published",
        ] {
            assert!(doc["paths"][path]["get"].is_object(), "no GET {path}");
        }
    }

    #[test]
    fn every_property_is_required_and_options_are_nullable() {
        let doc = doc();
        let summary = &doc["components"]["schemas"]["ServiceSummary"];
        let required: Vec<&str> = summary["required"]
            .as_array()
            .expect("required")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(required.contains(&"last_skip"), "{summary}");
        assert_eq!(
            summary["properties"]["last_skip"]["type"],
            serde_json::json!(["string", "null"])
        );
        // Fields with a serde default are written all the same.
        let params = &doc["components"]["schemas"]["Params"];
        assert!(params["required"]
            .as_array()
            .expect("required")
            .contains(&Value::from("cycle_ms")));
    }

    #[test]
    fn the_skip_reason_is_tagged_as_serde_tags_it() {
        let doc = doc();
        let reason = &doc["components"]["schemas"]["SkipReason"];
        let text = reason.to_string();
        for tag in ["grace", "missing", "thin_feedback", "no_serving_endpoints"] {
            assert!(text.contains(&format!("\"{tag}\"")), "{tag}: {reason}");
        }
        let grace = serde_json::to_value(ballast_balance::SkipReason::Grace { remaining_ms: 5 })
            .expect("serialises");
        assert_eq!(grace["reason"], "grace");
    }

    #[test]
    fn the_watch_stream_is_described_as_events_of_weight_sets() {
        let doc = doc();
        let content =
            &doc["paths"]["/v1/services/{name}/weights"]["get"]["responses"]["200"]["content"];
        assert!(content["application/json"].is_object(), "{content}");
        assert!(content["text/event-stream"].is_object(), "{content}");
        let data = &doc["components"]["schemas"]["WeightEvent"]["properties"]["data"];
        assert_eq!(
            data["contentSchema"]["$ref"],
            "#/components/schemas/WeightSet"
        );
    }
}
