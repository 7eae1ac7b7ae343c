// toml_names.h: the name of a TOML value's type, for the messages of the two loaders built on toml++ (the job
// config, src/job/config.cpp, and the planner's hardware files, src/plan/hardware.cpp). Not a loader.
#pragma once
#include <toml++/toml.h>

namespace moetron {

inline const char* toml_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::array: return "array";
    case toml::node_type::table: return "table";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

}  // namespace moetron
