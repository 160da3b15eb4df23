# Install the library, its headers and a CMake package: find_package(hostopt CONFIG).
include(CMakePackageConfigHelpers)

set(HOSTOPT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/hostopt)
# hostopt::store (the state on drives) links the drive layer privately: both are exported.
install(TARGETS hostopt hostopt_transfer hostopt_checksum hostopt_store hostopt_drive EXPORT hostoptTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/hostopt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp")
install(FILES ${PROJECT_BINARY_DIR}/include/hostopt/version.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/hostopt)
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/NOTICE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/hostopt)
install(EXPORT hostoptTargets NAMESPACE hostopt:: DESTINATION ${HOSTOPT_CMAKE_DIR})
# The same package in the build tree (hostopt_DIR=<build dir>), as {fmt} exports its own: the
# docs' C++ examples are built against it (tests/doc_cpp_examples.cmake).
export(EXPORT hostoptTargets NAMESPACE hostopt:: FILE ${PROJECT_BINARY_DIR}/hostoptTargets.cmake)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/hostoptConfig.cmake.in
  ${PROJECT_BINARY_DIR}/hostoptConfig.cmake INSTALL_DESTINATION ${HOSTOPT_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/hostoptConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/hostoptConfig.cmake ${PROJECT_BINARY_DIR}/hostoptConfigVersion.cmake
        DESTINATION ${HOSTOPT_CMAKE_DIR})
