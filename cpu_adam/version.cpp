#include "hostopt/version.hpp"

namespace hostopt {

const char* library_version() { return version_string; }

} // namespace hostopt
