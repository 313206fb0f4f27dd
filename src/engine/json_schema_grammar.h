// JSON Schema (a subset) -> byte-level Grammar, for structured output.
//
// Every sentence of the grammar is a JSON text that validates against the
// schema (oneOf: when its alternatives do not overlap); the grammar allows a
// subset of the valid texts, chosen so that generation always ends:
// no whitespace except one optional space after ':' and ',', numbers of at
// most 16 integer / 16 fraction / 3 exponent digits, properties in the
// schema's order, no properties beyond `properties` unless
// additionalProperties is true or a schema.
//
// Supported: type (object, array, string, number, integer, boolean, null,
// and lists of them), properties, required, additionalProperties
// (false/true/schema; absent: none generated), items, minItems, maxItems,
// enum, const, anyOf, oneOf, allOf with one schema, $ref to local JSON
// pointers ("#", "#/$defs/x", "#/definitions/x"; recursion allowed),
// minLength, maxLength, format (date, time, date-time, uuid enforced; other
// formats generate a plain string, as format is an annotation by default),
// and the annotations title, description, default, examples, $schema, $id,
// $comment, deprecated, readOnly, writeOnly. Any other keyword is a
// JsonSchemaError naming it and where it is.
#pragma once
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/grammar.h"

namespace flashmoe {

// A schema the compiler cannot or will not turn into a grammar. The message
// names the keyword and its location ("#/properties/age"), safe to show to
// an API client.
class JsonSchemaError : public Error {
 public:
  using Error::Error;
};

// Properties are generated in the order the schema lists them, so the
// schema must come from an order-keeping parse (ordered_json).
Grammar json_schema_grammar(const nlohmann::ordered_json& schema);

// Any JSON object (response_format json_object).
Grammar json_object_grammar();

}  // namespace flashmoe
